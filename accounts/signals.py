"""A member's keys end with their membership, and every key of a deactivated account with it,
however the row changed: the admin's forms and bulk actions, the team page's inline, or any
code saving or deleting the rows. (Queryset `update()`s send no signals; authentication refuses
those keys anyway, accounts/authentication.py.) Signing out ends the user's playground keys."""

from django.conf import settings
from django.contrib.auth.signals import user_logged_out
from django.db.models.signals import post_delete, post_save, pre_save
from django.dispatch import receiver

from accounts.models import Membership
from accounts.services import (
    api_keys_revoke_for_member,
    api_keys_revoke_for_user,
    playground_keys_revoke_for_user,
)


@receiver(post_delete, sender=Membership, dispatch_uid="orchard-membership-deleted")
def membership_deleted(sender, instance: Membership, **kwargs) -> None:
    api_keys_revoke_for_member(team_id=instance.team_id, user_id=instance.user_id)


@receiver(pre_save, sender=Membership, dispatch_uid="orchard-membership-moved")
def membership_moved(sender, instance: Membership, raw: bool = False, **kwargs) -> None:
    # A membership edited to another team or user ends the one it was.
    if raw or instance.pk is None:
        return
    was = Membership.objects.filter(pk=instance.pk).values("team_id", "user_id").first()
    if was and (was["team_id"], was["user_id"]) != (instance.team_id, instance.user_id):
        api_keys_revoke_for_member(**was)


@receiver(post_save, sender=settings.AUTH_USER_MODEL, dispatch_uid="orchard-user-saved")
def user_saved(sender, instance, raw: bool = False, **kwargs) -> None:
    if not raw and not instance.is_active:
        api_keys_revoke_for_user(user_id=instance.pk)


@receiver(user_logged_out, dispatch_uid="orchard-playground-signed-out")
def signed_out(sender, request, user, **kwargs) -> None:
    # The playground's keys live as long as its pages, which signing out ends.
    if user is not None:
        playground_keys_revoke_for_user(user_id=user.pk)
