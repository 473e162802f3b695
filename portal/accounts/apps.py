from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "portal.accounts"
    label = "accounts"
    verbose_name = "Accounts and API tokens"

    def ready(self) -> None:
        from django.core import checks

        from portal.secrets_check import check_secret_key

        checks.register(check_secret_key, checks.Tags.security)
