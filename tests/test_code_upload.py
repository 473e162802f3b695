"""A job's own code through the API: uploaded as a tar.gz or zip, checked (size, files that
would leave the directory, links), stored once by the sha256 of its canonical form, downloadable
by its uploader and staff only, named by a job spec, and fetched by an agent only for a job its
node runs."""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from portal.accounts.models import ApiToken
from portal.cluster.models import Node
from portal.jobs.models import Job
from portal.scheduling.cycle import run_cycle
from tests.code_support import RINGS, directory_files, tar_gz, zip_of

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def code_dir(settings: Any, tmp_path: Path) -> Path:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    return tmp_path / "code"


def upload(tokens: dict[str, str], user: str, data: bytes, name: str = "code.tar.gz") -> Any:
    from django.core.files.uploadedfile import SimpleUploadedFile

    return Client().post(
        "/api/code",
        {"file": SimpleUploadedFile(name, data)},
        HTTP_AUTHORIZATION=f"Bearer {tokens[user]}",
    )


def error_of(reply: Any) -> dict[str, Any]:
    body = reply.json()["error"]
    assert body["status"] == reply.status_code
    return dict(body)


def test_the_same_directory_as_tar_gz_or_zip_is_one_digest(tokens: dict, code_dir: Path) -> None:
    files = directory_files(RINGS)
    first = upload(tokens, "alice", tar_gz(files, top="rings/"))
    second = upload(tokens, "alice", zip_of(files), name="code.zip")
    assert first.status_code == second.status_code == 201, (first.content, second.content)
    assert first.json()["digest"] == second.json()["digest"]
    assert sorted(first.json()["files"]) == sorted(files)
    stored = code_dir / f"{first.json()['digest']}.tar.gz"
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == first.json()["digest"]


def test_bungeeignore_leaves_files_out(tokens: dict) -> None:
    files = {"task.py": b"x = 1\n", ".bungeeignore": b"# big things\ndata/\n*.ckpt\n", "data/a.bin": b"1",
             "run.ckpt": b"2", "sub/keep.py": b"y = 2\n"}
    reply = upload(tokens, "alice", tar_gz(files))
    assert reply.status_code == 201, reply.content
    assert sorted(reply.json()["files"]) == [".bungeeignore", "sub/keep.py", "task.py"]


def test_too_big_is_413_in_the_error_shape(tokens: dict, settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"code_max_bytes": 2000})
    data = tar_gz({"weights.bin": random.Random(0).randbytes(10_000)})  # random: gzip keeps it big
    reply = upload(tokens, "alice", data)
    assert reply.status_code == 413
    error = error_of(reply)
    assert error["code"] == "too_large" and "at most 2000 bytes" in error["message"]
    assert error["fields"][0]["field"] == "file"


def test_code_that_unpacks_too_big_is_413(tokens: dict, settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"code_max_unpacked_bytes": 10_000})
    reply = upload(tokens, "alice", zip_of({"zeros.bin": bytes(1_000_000)}), name="bomb.zip")
    assert reply.status_code == 413
    assert "unpacks to 1000000 bytes; at most 10000 are taken (BUNGEE_CODE_MAX_UNPACKED_BYTES)" in error_of(reply)["message"]


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (tar_gz({"../evil.py": b"x"}), "../evil.py"),
        (tar_gz({"/etc/evil.py": b"x"}), "/etc/evil.py"),
        (tar_gz({"ok/../../evil.py": b"x"}), "ok/../../evil.py"),
        (tar_gz({"task.py": b"x"}, links={"secrets": "/etc/shadow"}), "secrets"),
        (tar_gz({"task.py": b"x"}, links={"copy": "task.py"}, hard=True), "copy"),
        (zip_of({"task.py": b"x"}, links={"escape": "../../etc"}), "escape"),
        (zip_of({"../evil.py": b"x"}), "../evil.py"),
        (b"this is no archive at all", "not a tar.gz or zip"),
    ],
)
def test_an_archive_that_escapes_or_is_none_is_400_naming_the_member(
    tokens: dict, code_dir: Path, data: bytes, named: str
) -> None:
    reply = upload(tokens, "alice", data)
    assert reply.status_code == 400, reply.content
    error = error_of(reply)
    assert error["code"] == "invalid_archive" and named in error["message"]
    assert not list(code_dir.glob("*.tar.gz")), "nothing is stored"


def test_a_request_without_the_file_is_400(tokens: dict) -> None:
    reply = Client().post("/api/code", {"other": "x"}, HTTP_AUTHORIZATION=f"Bearer {tokens['alice']}")
    assert reply.status_code == 400 and error_of(reply)["fields"][0]["field"] == "file"
    assert Client().post("/api/code", {}).status_code == 401


def test_only_the_uploader_and_staff_may_download(tokens: dict) -> None:
    digest = upload(tokens, "alice", tar_gz(directory_files(RINGS))).json()["digest"]
    for user, status in (("alice", 200), ("staff", 200), ("bob", 404)):
        reply = Client().get(f"/api/code/{digest}", HTTP_AUTHORIZATION=f"Bearer {tokens[user]}")
        assert reply.status_code == status, (user, reply.status_code)
        if status == 200:
            assert hashlib.sha256(b"".join(reply.streaming_content)).hexdigest() == digest
    assert Client().get(f"/api/code/{digest}").status_code == 401
    bad = Client().get("/api/code/not-a-digest", HTTP_AUTHORIZATION=f"Bearer {tokens['alice']}")
    assert bad.status_code == 400 and error_of(bad)["fields"][0]["value"] == "not-a-digest"
    assert [row["digest"] for row in Client().get(
        "/api/code", HTTP_AUTHORIZATION=f"Bearer {tokens['bob']}").json()] == []


CODE_JOB = {"name": "rings", "entrypoint": "task:RingsTask", "max_workers": 2, "steps": 20,
            "hyperparameters": {"batch_size": 24}}


def test_a_job_names_its_code_and_only_its_uploader_may_run_it(tokens: dict, api: dict) -> None:
    digest = upload(tokens, "alice", tar_gz(directory_files(RINGS))).json()["digest"]
    reply = api["alice"].post("/api/jobs", {**CODE_JOB, "code": digest})
    assert reply.status_code == 201, reply.content
    job = Job.objects.get(pk=reply.json()["id"])
    assert job.code == digest and job.workload.startswith("task:RingsTask of code ")
    assert reply.json()["spec"]["virtual_workers"] == 2
    refused = api["bob"].post("/api/jobs", {**CODE_JOB, "code": digest})
    assert refused.status_code == 400
    [field] = error_of(refused)["fields"]
    assert field["field"] == "code" and field["value"] == digest


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hyperparameters": {}}, "hyperparameters.batch_size"),
        ({"steps": None, "epochs": 2}, "epochs"),
        ({"workload": "digits-mlp"}, "code"),
        ({"entrypoint": None}, "entrypoint"),
        ({"entrypoint": "task"}, "entrypoint"),
        ({"code": "abc"}, "code"),
    ],
)
def test_a_code_spec_that_does_not_hold_together_is_400(
    tokens: dict, api: dict, change: dict, field: str
) -> None:
    digest = upload(tokens, "alice", tar_gz({"task.py": b"x = 1\n"})).json()["digest"]
    spec = {key: value for key, value in {**CODE_JOB, "code": digest, **change}.items() if value is not None}
    reply = api["alice"].post("/api/jobs", spec)
    assert reply.status_code == 400, reply.content
    assert field in [f["field"] for f in error_of(reply)["fields"]]
    assert not Job.objects.exists()


def test_an_agent_fetches_only_the_code_of_a_job_its_node_runs(
    tokens: dict, api: dict, users: dict, cluster: Any
) -> None:
    digest = upload(tokens, "alice", tar_gz(directory_files(RINGS))).json()["digest"]
    other = upload(tokens, "alice", tar_gz({"task.py": b"y = 2\n"})).json()["digest"]
    agent = ApiToken.lookup(tokens["agent"])
    Node.objects.filter(pk=cluster.pk).update(agent_token=agent)

    def fetch(code: str) -> Any:
        return Client().get(f"/api/agent/code/{code}", HTTP_AUTHORIZATION=f"Bearer {tokens['agent']}")

    assert fetch(digest).status_code == 403, "no job runs it yet"
    api["alice"].post("/api/jobs", {**CODE_JOB, "code": digest})
    run_cycle()
    reply = fetch(digest)
    assert reply.status_code == 200
    assert hashlib.sha256(b"".join(reply.streaming_content)).hexdigest() == digest
    assert fetch(other).status_code == 403
    user_token = Client().get(f"/api/agent/code/{digest}", HTTP_AUTHORIZATION=f"Bearer {tokens['alice']}")
    assert user_token.status_code == 403


@pytest.mark.parametrize(
    ("entrypoint", "said"),
    [
        ("task:RingTask", "module 'task' defines no class 'RingTask'; its classes: RingsHyperparameters, RingsTask"),
        ("tsk:RingsTask", "the code has no module 'tsk' (no tsk.py or tsk/__init__.py at its top); its modules: data, task"),
    ],
)
def test_an_entrypoint_the_code_lacks_is_400_listing_what_it_has(
    tokens: dict, api: dict, entrypoint: str, said: str
) -> None:
    """Found at submit from the module's source, without running it, not when the job runs."""
    digest = upload(tokens, "alice", tar_gz(directory_files(RINGS))).json()["digest"]
    reply = api["alice"].post("/api/jobs", {**CODE_JOB, "code": digest, "entrypoint": entrypoint})
    assert reply.status_code == 400, reply.content
    [field] = error_of(reply)["fields"]
    assert field["field"] == "entrypoint" and field["value"] == entrypoint and said in field["message"]
    assert Job.objects.count() == 0


def test_a_code_upload_over_the_limit_says_how_to_leave_files_out(tokens: dict, settings: Any) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"code_max_bytes": 2000})
    message = error_of(upload(tokens, "alice", tar_gz({"w.bin": random.Random(0).randbytes(10_000)})))[
        "message"
    ]
    assert "at most 2000 bytes (BUNGEE_CODE_MAX_BYTES)" in message and ".bungeeignore" in message


def test_a_dry_run_checks_the_spec_and_says_whether_the_code_is_there(tokens: dict, api: dict) -> None:
    files = directory_files(RINGS)
    digest = upload(tokens, "alice", tar_gz(files)).json()["digest"]
    checked = api["alice"].post("/api/jobs/validate", {**CODE_JOB, "code": digest})
    assert checked.status_code == 200, checked.content
    assert checked.json()["code_uploaded"] is True and checked.json()["spec"]["virtual_workers"] == 2
    for user in ("bob", "alice"):  # bob's is not there for him; alice's other code not yet uploaded
        other = digest if user == "bob" else "0" * 64
        reply = api[user].post("/api/jobs/validate", {**CODE_JOB, "code": other, "entrypoint": "task:Nope"})
        assert reply.status_code == 200 and reply.json()["code_uploaded"] is False, reply.content
    wrong = api["alice"].post("/api/jobs/validate", {**CODE_JOB, "code": digest, "entrypoint": "task:Nope"})
    assert wrong.status_code == 400 and error_of(wrong)["fields"][0]["field"] == "entrypoint"
    typo = api["alice"].post("/api/jobs/validate", {**CODE_JOB, "code": digest, "max_wokers": 2})
    assert error_of(typo)["fields"][0]["message"] == "unknown field; did you mean max_workers?"
    assert Job.objects.count() == 0


def test_the_docs_state_the_real_code_limits() -> None:
    """Where a page gives a code limit a size, it is the setting's default, in bytes too."""
    import portal.settings

    defaults = {
        f"BUNGEE_{name.upper()}": f"{getattr(portal.settings.BUNGEE, name):,} bytes"
        for name in ("code_max_bytes", "code_max_unpacked_bytes")
    }
    root = Path(__file__).resolve().parent.parent
    stating = [line for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
               for line in page.read_text().splitlines() if "BUNGEE_CODE_MAX_BYTES" in line and re.search(r"\d M(i)?B", line)]
    assert stating, "some page states the limit"
    for line in stating:
        assert all(default in line for setting, default in defaults.items() if f"`{setting}`" in line), line


@pytest.mark.parametrize(
    ("files", "where", "said"),
    [
        ({"requirements.txt": b"einops==0.8\n# the node's torch is too new for me\ntorch<2\n"},
         "requirements.txt line 3", "the nodes run torch"),
        ({"pyproject.toml": b'[project]\nname = "mine"\ndependencies = ["einops", "torch==1.13"]\n'},
         "pyproject.toml dependencies[1]", "the nodes run torch"),
        ({"requirements.txt": b"einops\n-e ./mylib\n"}, "requirements.txt line 2", "option -e is not taken"),
        ({"requirements.txt": b"--index-url https://example.org/simple\neinops\n"}, "requirements.txt line 1",
         "option --index-url is not taken"),
        ({"requirements.txt": b"mylib @ file:///home/me/mylib\n"}, "requirements.txt line 1", "a local path"),
        ({"requirements.txt": b"einops >= \n"}, "requirements.txt line 1", "not a requirement"),
    ],
)
def test_requirements_a_node_cannot_build_are_400_naming_the_line(
    tokens: dict, code_dir: Path, files: dict[str, bytes], where: str, said: str
) -> None:
    reply = upload(tokens, "alice", tar_gz({"task.py": b"x = 1\n", **files}))
    assert reply.status_code == 400, reply.content
    error = error_of(reply)
    assert error["code"] == "invalid_requirements"
    assert where in error["message"] and said in error["message"], error
    assert error["fields"][0]["field"] == "file" and where in error["fields"][0]["message"]
    assert list(code_dir.glob("*.tar.gz")) == []


def test_requirements_the_nodes_can_build_are_taken(tokens: dict) -> None:
    files = {"task.py": b"x = 1\n", "requirements.txt": b"einops>=0.8  # layers\ntorch>=2\n\nmylib @ https://example.org/mylib-1.0-py3-none-any.whl\n"}
    reply = upload(tokens, "alice", tar_gz(files))
    assert reply.status_code == 201, reply.content


def test_index_options_are_taken_where_the_operator_allows_them(tokens: dict, settings: Any) -> None:
    files = {"task.py": b"x = 1\n", "requirements.txt": b"--index-url https://pypi.lab.example/simple\neinops\n"}
    refused = upload(tokens, "alice", tar_gz(files))
    assert refused.status_code == 400 and "BUNGEE_ENV_INDEX_OPTIONS" in error_of(refused)["message"]
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"env_index_options": True})
    assert upload(tokens, "alice", tar_gz(files)).status_code == 201
    editable = upload(tokens, "alice", tar_gz({**files, "requirements.txt": b"-e ./mylib\n"}))
    assert editable.status_code == 400, "an editable or local path never is"
