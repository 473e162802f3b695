from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from portal.api import api
from portal.jobs import views as job_views

urlpatterns = [
    path("", job_views.job_list, name="job-list"),
    path("jobs/<int:job_id>/", job_views.job_page, name="job-page"),
    path("login/", auth_views.LoginView.as_view(template_name="login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
]
