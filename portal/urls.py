from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from portal.api import api
from portal.error_pages import forbidden_page, not_found_page
from portal.health import healthz, readyz
from portal.jobs import views
from portal.metrics import metrics_view
from portal.scheduling.views import scheduler_page

urlpatterns = [
    path("", views.board, name="board"),
    path("jobs/", views.job_list, name="job-list"),
    path("jobs/new/", views.submit_page, name="job-submit"),
    path("jobs/<int:job_id>/", views.job_page, name="job-page"),
    path("login/", auth_views.LoginView.as_view(template_name="login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/scheduler/", scheduler_page, name="scheduler"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
    path("metrics", metrics_view, name="metrics"),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
]

handler403 = forbidden_page
handler404 = not_found_page
