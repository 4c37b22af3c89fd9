from django.urls import path

from inference.api import chat, completions, models

urlpatterns = [
    path("models", models.models_list, name="v1-models"),
    path("models/<path:model_id>", models.model_detail, name="v1-model-detail"),
    path("chat/completions", chat.chat_completions, name="v1-chat-completions"),
    path("completions", completions.completions, name="v1-completions"),
]
