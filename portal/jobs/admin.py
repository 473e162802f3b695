from django.contrib import admin

from portal.jobs.models import Allocation, Job, JobLog, JobMetric, ResizeEvent, Worker


class AllocationInline(admin.TabularInline):
    model = Allocation
    extra = 0


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "workload", "state", "generation", "steps_done", "total_steps")
    list_filter = ("state", "priority", "consistency", "workload")
    search_fields = ("name", "owner__username")
    inlines = [AllocationInline]


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ("job", "generation", "rank", "node", "device_index", "pid", "state", "reason")
    list_filter = ("state", "reason")


@admin.register(ResizeEvent)
class ResizeEventAdmin(admin.ModelAdmin):
    list_display = ("job", "generation", "reason", "workers_before", "workers_after", "pause_s")


@admin.register(JobMetric)
class JobMetricAdmin(admin.ModelAdmin):
    list_display = ("job", "step", "loss", "samples_per_s", "at")


@admin.register(JobLog)
class JobLogAdmin(admin.ModelAdmin):
    list_display = ("job", "rank", "at", "line")
