from django.urls import path

from inference.api import chat, completions, costs, embeddings, models, usage
from inference.api.anthropic import views as anthropic
from inference.api.responses import views as responses
from inference.batches import file_views
from inference.batches import views as batches

urlpatterns = [
    path("models", models.models_list, name="v1-models"),
    path("models/<path:model_id>", models.model_detail, name="v1-model-detail"),
    path("chat/completions", chat.chat_completions, name="v1-chat-completions"),
    path("completions", completions.completions, name="v1-completions"),
    path("embeddings", embeddings.embeddings, name="v1-embeddings"),
    path("organization/usage/completions", usage.usage_completions, name="v1-usage-completions"),
    path("organization/costs", costs.organization_costs, name="v1-organization-costs"),
    path("messages", anthropic.messages_create, name="v1-messages"),
    path("messages/count_tokens", anthropic.count_tokens, name="v1-messages-count-tokens"),
    path("responses", responses.responses_create, name="v1-responses"),
    path("responses/<str:response_id>", responses.response_detail, name="v1-response"),
    path(
        "responses/<str:response_id>/input_items",
        responses.response_input_items,
        name="v1-response-input-items",
    ),
    path("files", file_views.files, name="v1-files"),
    path("files/<str:file_id>", file_views.file_detail, name="v1-file"),
    path("files/<str:file_id>/content", file_views.file_content, name="v1-file-content"),
    path("batches", batches.batches, name="v1-batches"),
    path("batches/<str:batch_id>", batches.batch_detail, name="v1-batch"),
    path("batches/<str:batch_id>/cancel", batches.batch_cancel_view, name="v1-batch-cancel"),
]
