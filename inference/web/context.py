"""What every page's navigation needs to know about the signed-in user."""

from accounts.selectors import teams_owned_by


def navigation(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"owns_team": user.is_superuser or teams_owned_by(user=user).exists()}
