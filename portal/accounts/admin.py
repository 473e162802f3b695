from typing import Any

from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import HttpRequest

from portal.accounts.models import ApiToken


class PoolFilter(admin.SimpleListFilter):
    """A pool's token with the tokens it issued its nodes, or every token a pool issued."""

    title = "pool"
    parameter_name = "pool"
    ISSUED = "__issued__"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        pools = ApiToken.objects.exclude(pool="").values_list("pool", flat=True).distinct().order_by("pool")
        return [(self.ISSUED, "any pool's node tokens"), *((pool, f"pool {pool}") for pool in pools)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> QuerySet[ApiToken] | None:
        if self.value() == self.ISSUED:
            return queryset.filter(issued_by__isnull=False)
        if self.value():
            return queryset.filter(Q(pool=self.value()) | Q(issued_by__pool=self.value()))
        return None


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("label", "user", "role", "pool", "issued_by", "prefix", "created_at", "last_used_at")
    list_filter = ("role", PoolFilter)
    readonly_fields = ("digest", "prefix", "pool", "issued_by", "created_at", "last_used_at")
