from django.contrib import admin
from django.urls import include, path

from inference.api.metrics import metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics, name="metrics"),
    path("v1/", include("inference.urls")),
    path("", include("inference.web.urls")),
]
