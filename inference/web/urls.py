from django.urls import path

from inference.web import batches, playground, views

urlpatterns = [
    path("", views.home, name="web-home"),
    path("accounts/login/", views.login_view(), name="web-login"),
    path("accounts/logout/", views.logout_view(), name="web-logout"),
    path(
        "accounts/set-password/<uidb64>/<token>/",
        views.password_set_view(),
        name="web-password-set",
    ),
    path(
        "accounts/set-password/done/", views.password_set_done_view(), name="web-password-set-done"
    ),
    path("keys/", views.keys, name="web-keys"),
    path("usage/", views.usage, name="web-usage"),
    path("models/", views.models_page, name="web-models"),
    path("batches/", batches.batches_page, name="web-batches"),
    path("batches/files/<str:file_id>/", batches.batch_file_download, name="web-batch-file"),
    path("batches/<str:batch_id>/cancel/", batches.batch_cancel_page, name="web-batch-cancel"),
    path("playground/", playground.playground, name="web-playground"),
    path("playground/key/", playground.playground_key, name="web-playground-key"),
    path("playground/key/end/", playground.playground_key_end, name="web-playground-key-end"),
    path("teams/", views.team_reports, name="web-teams"),
    path("teams/<int:team_id>/", views.team_report, name="web-team-report"),
]
