from django.contrib import admin

from portal.scheduling.models import SchedulerDecision


@admin.register(SchedulerDecision)
class SchedulerDecisionAdmin(admin.ModelAdmin):
    list_display = ("decided_at", "policy", "decision_ms", "devices_available", "devices_total")
    readonly_fields = [field.name for field in SchedulerDecision._meta.fields]
