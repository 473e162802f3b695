"""`make demo` restarted over the same database: its two example jobs are submitted once, not again
while they are still active (they would take the demo node's four devices between them), and
again once they have ended. Driven through the portal's API in process."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from portal.accounts.models import ApiToken
from portal.demo import DEMO_USER, EXAMPLE_JOBS, submit_example_jobs
from portal.jobs.models import Job

pytestmark = pytest.mark.django_db


class ThroughDjango(httpx.BaseTransport):
    """The demo's requests answered by the portal in this process (Django's test client)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path + (f"?{request.url.query.decode()}" if request.url.query else "")
        reply = Client().generic(request.method, path, request.read(), content_type="application/json",
                                 HTTP_AUTHORIZATION=request.headers["authorization"])
        return httpx.Response(reply.status_code, headers=dict(reply.headers), content=reply.content)


@pytest.fixture
def demo_api() -> Iterator[httpx.Client]:
    user = get_user_model().objects.create_user(DEMO_USER, is_staff=True)
    token = ApiToken.issue(user, "demo script")[1]
    with httpx.Client(base_url="http://testserver", headers={"Authorization": f"Bearer {token}"},
                      transport=ThroughDjango()) as client:
        yield client


def test_a_restart_does_not_submit_the_example_jobs_again_while_they_are_active(demo_api: httpx.Client) -> None:
    first = submit_example_jobs(demo_api)
    assert [line.startswith("submitted job") for line in first] == [True] * len(EXAMPLE_JOBS)
    assert Job.objects.count() == len(EXAMPLE_JOBS)
    again = submit_example_jobs(demo_api)
    assert Job.objects.count() == len(EXAMPLE_JOBS), "a restart submits nothing while they are active"
    assert all("not submitted again" in line for line in again), again
    ended = Job.objects.get(name=EXAMPLE_JOBS[0]["name"])
    assert demo_api.post(f"/api/jobs/{ended.pk}/cancel").status_code == 200
    third = submit_example_jobs(demo_api)
    assert third[0].startswith("submitted job") and "not submitted again" in third[1], third
    assert Job.objects.filter(name=EXAMPLE_JOBS[0]["name"]).count() == 2
