from django.apps import AppConfig


class SlurmConfig(AppConfig):
    name = "portal.slurm"
    label = "slurm"
    verbose_name = "Slurm pool"

    def ready(self) -> None:
        from django.core import checks

        from portal.cluster.binding import add_pool_rules
        from portal.slurm.config import check_pool_setting
        from portal.slurm.registration import rule_for

        checks.register(check_pool_setting)
        add_pool_rules(rule_for)
