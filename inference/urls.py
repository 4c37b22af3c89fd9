from django.urls import path

from inference import views

urlpatterns = [
    path("models", views.models_list, name="v1-models"),
    path("models/<path:model_id>", views.model_detail, name="v1-model-detail"),
    path("chat/completions", views.chat_completions, name="v1-chat-completions"),
    path("completions", views.completions, name="v1-completions"),
]
