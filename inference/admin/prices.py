"""Admin for model prices: an inline of each model's price history on its registry page, and the
list of every model's prices.

A price is history once in force: it cannot be changed or deleted (a change is a new price from a
later time), and a new price cannot start in the past, so no recorded cost and no price a request
was admitted at is ever rewritten. A price not yet in force may still be changed or removed.
"""

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.utils import timezone

from common.money import currency
from inference.models import ModelPrice

ERROR_IN_FORCE = (
    "The price from {start} is in force or past: it cannot be changed or removed. Add a new "
    "price from a later time instead."
)
ERROR_IN_THE_PAST = (
    "A new price cannot start in the past (requests were billed at the price then in force). "
    "Leave the time empty for now."
)


class ModelPriceForm(forms.ModelForm):
    class Meta:
        model = ModelPrice
        fields = [
            "effective_from",
            "input_per_million",
            "cached_input_per_million",
            "output_per_million",
            "per_image",
        ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["effective_from"].required = False
        self.fields["effective_from"].help_text = "UTC. Empty: now."
        for name in ("input_per_million", "cached_input_per_million", "output_per_million"):
            field = self.fields[name]
            field.help_text = f"{field.help_text} In {currency()}."
            field.widget.attrs.setdefault("aria-label", f"{field.label} per million tokens")
        self.fields["per_image"].widget.attrs.setdefault("aria-label", "Price per image")

    def clean(self):
        cleaned = super().clean()
        now = timezone.now()
        instance = self.instance
        if not instance._state.adding and instance.effective_from <= now and self.has_changed():
            raise ValidationError(ERROR_IN_FORCE.format(start=f"{instance.effective_from:%c}"))
        start = cleaned.get("effective_from")
        if start is None:
            cleaned["effective_from"] = now
        elif instance._state.adding or "effective_from" in self.changed_data:
            if start < now:
                self.add_error("effective_from", ERROR_IN_THE_PAST)
        return cleaned


class ModelPriceFormSet(forms.BaseInlineFormSet):
    def __init__(self, data=None, files=None, instance=None, prefix=None, **kwargs):
        prefix = prefix or self.get_default_prefix()
        if data is not None and f"{prefix}-TOTAL_FORMS" not in data:
            # A post of the model's page without its prices (a script's, or a form from before
            # prices existed): the prices stay as they are, the rest of the page is saved.
            data = data.copy()
            data.update({f"{prefix}-TOTAL_FORMS": "0", f"{prefix}-INITIAL_FORMS": "0"})
        super().__init__(data, files, instance=instance, prefix=prefix, **kwargs)

    def clean(self):
        super().clean()
        now = timezone.now()
        for form in self.deleted_forms:
            price = form.instance
            if price.pk is not None and price.effective_from <= now:
                raise ValidationError(ERROR_IN_FORCE.format(start=f"{price.effective_from:%c}"))


class ModelPriceInline(admin.TabularInline):
    """On the model's registry page: its prices, newest first."""

    model = ModelPrice
    form = ModelPriceForm
    formset = ModelPriceFormSet
    extra = 1
    ordering = ["-effective_from"]
    verbose_name = "price"
    verbose_name_plural = "prices (per million tokens; a change is a new price from a later time)"


@admin.register(ModelPrice)
class ModelPriceAdmin(admin.ModelAdmin):
    """Every model's price history, in one list (edited on each model's page)."""

    list_display = [
        "model",
        "effective_from",
        "input_per_million",
        "cached_input_per_million",
        "output_per_million",
        "per_image",
        "in_force",
    ]
    list_filter = ["model"]
    list_select_related = ["model"]
    ordering = ["model__name", "-effective_from"]

    @admin.display(description="state")
    def in_force(self, obj: ModelPrice) -> str:
        now = timezone.now()
        if obj.effective_from > now:
            return "from then on"
        newer = ModelPrice.objects.filter(
            model_id=obj.model_id, effective_from__gt=obj.effective_from, effective_from__lte=now
        )
        return "past" if newer.exists() else "in force"

    def has_add_permission(self, request):
        return False  # on the model's page, beside its history

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
