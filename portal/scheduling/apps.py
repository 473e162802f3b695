from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "portal.scheduling"
    label = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        from django.core import checks

        from portal.scheduling.policy import check_policy_setting

        checks.register(check_policy_setting)
