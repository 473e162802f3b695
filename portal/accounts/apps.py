from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "portal.accounts"
    label = "accounts"
    verbose_name = "Accounts and API tokens"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_login_failed
        from django.core import checks

        from portal.accounts.login_throttle import count_failed_login
        from portal.secrets_check import check_secret_key

        checks.register(check_secret_key, checks.Tags.security)
        user_login_failed.connect(count_failed_login, dispatch_uid="bungee-login-throttle")
