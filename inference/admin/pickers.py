"""The registry's model names for the model pickers of accounts' admin forms (the key's allowed
models, the models of the keys a team's members create): accounts holds model names but does
not read the registry."""

from accounts.admin import model_names_source
from inference.models import ModelEntry


def registered_model_names() -> list[str]:
    return list(ModelEntry.objects.order_by("name").values_list("name", flat=True))


model_names_source(registered_model_names)
