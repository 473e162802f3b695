from django.contrib import admin

from portal.cluster.models import Device, DeviceSample, Node


class DeviceInline(admin.TabularInline):
    model = Device
    extra = 0


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "address", "backend", "state", "last_seen_at")
    list_filter = ("state", "backend")
    inlines = [DeviceInline]


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("__str__", "name", "kind", "present", "owner_present")
    list_filter = ("kind", "owner_present", "node")


@admin.register(DeviceSample)
class DeviceSampleAdmin(admin.ModelAdmin):
    list_display = ("device", "taken_at", "utilization_pct", "memory_used_bytes")
    list_filter = ("device__node",)
