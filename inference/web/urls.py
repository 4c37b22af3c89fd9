from django.urls import path

from inference.web import views

urlpatterns = [
    path("", views.home, name="web-home"),
    path("accounts/login/", views.login_view(), name="web-login"),
    path("accounts/logout/", views.logout_view(), name="web-logout"),
    path("keys/", views.keys, name="web-keys"),
    path("usage/", views.usage, name="web-usage"),
    path("models/", views.models_page, name="web-models"),
    path("teams/", views.team_reports, name="web-teams"),
    path("teams/<int:team_id>/", views.team_report, name="web-team-report"),
]
