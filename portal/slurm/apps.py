from django.apps import AppConfig


class SlurmConfig(AppConfig):
    name = "portal.slurm"
    label = "slurm"
    verbose_name = "Slurm pool"

    def ready(self) -> None:
        from django.core import checks

        from portal.slurm.config import check_pool_setting

        checks.register(check_pool_setting)
