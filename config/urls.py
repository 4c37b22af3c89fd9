from django.contrib import admin
from django.urls import include, path

from inference.api.health import healthz, readyz
from inference.api.metrics import metrics
from inference.web.views import admin_login_view

urlpatterns = [
    # Before the admin's own URLs: its sign-in form, under the members' sign-in throttle.
    path("admin/login/", admin_login_view(), name="admin-login"),
    path("admin/", admin.site.urls),
    path("metrics", metrics, name="metrics"),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("v1/", include("inference.urls")),
    path("", include("inference.web.urls")),
]
