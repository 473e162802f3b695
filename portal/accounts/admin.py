from django.contrib import admin

from portal.accounts.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("label", "user", "role", "prefix", "created_at", "last_used_at")
    list_filter = ("role",)
    readonly_fields = ("digest", "prefix", "created_at", "last_used_at")
