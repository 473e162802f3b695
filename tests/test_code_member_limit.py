"""An archive that lists more members than BUNGEE_CODE_MAX_FILES is refused while its index is
read, at the first member past the limit, not after every member has been parsed: a zip whose
end record says so before any ZipInfo is built, a zip whose end record understates its count
while its central directory is walked (zipfile builds a ZipInfo for every record), a tar at the
header after the limit. The refusal is 413 in the API's error shape and names the count, the
limit and the setting, through the API and through the submit page."""

from __future__ import annotations

import io
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.code_support import tar_gz, zip_of

pytestmark = pytest.mark.django_db

LIMIT = 10


@pytest.fixture(autouse=True)
def limits(settings: Any, tmp_path: Path) -> None:
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path, "code_max_files": LIMIT})


@pytest.fixture
def zip_infos_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every ZipInfo built while the test runs (zipfile builds one per central
    directory record as it opens an archive)."""
    built: list[str] = []
    original = zipfile.ZipInfo.__init__

    def counting(self: zipfile.ZipInfo, filename: str = "NoName", *args: Any, **kwargs: Any) -> None:
        built.append(filename)
        original(self, filename, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipInfo, "__init__", counting)
    return built


@pytest.fixture
def tar_headers_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every member whose header a TarFile read (a TarInfo built) while the test runs."""
    read: list[str] = []
    original = tarfile.TarInfo.fromtarfile.__func__  # type: ignore[attr-defined]

    def counting(cls: type[tarfile.TarInfo], tar: tarfile.TarFile) -> tarfile.TarInfo:
        member: tarfile.TarInfo = original(cls, tar)
        read.append(member.name)
        return member

    monkeypatch.setattr(tarfile.TarInfo, "fromtarfile", classmethod(counting))
    return read


def files(count: int) -> dict[str, bytes]:
    return {f"f{index}.py": b"x" for index in range(count)}


def understated(archive: bytes, listed: int) -> bytes:
    """The zip `archive` with its end record claiming `listed` members (zipfile reads the central
    directory by its size and never looks at the count)."""
    end = archive.rindex(b"PK\x05\x06")
    return archive[: end + 8] + struct.pack("<HH", listed, listed) + archive[end + 12 :]


def upload(tokens: dict[str, str], data: bytes, name: str) -> Any:
    from django.core.files.uploadedfile import SimpleUploadedFile

    return Client().post("/api/code", {"file": SimpleUploadedFile(name, data)},
                         HTTP_AUTHORIZATION=f"Bearer {tokens['alice']}")


def refusal(reply: Any) -> str:
    assert reply.status_code == 413, reply.content
    error = reply.json()["error"]
    assert error["status"] == 413 and error["code"] == "too_large"
    [field] = error["fields"]
    assert field["field"] == "file" and "BUNGEE_CODE_MAX_FILES" in field["message"]
    assert f"at most {LIMIT} are taken (BUNGEE_CODE_MAX_FILES)" in error["message"]
    return str(error["message"])


def zip64(files: dict[str, bytes]) -> bytes:
    """A zip whose count is in its zip64 end record, as archives of over 65,535 members have it:
    the classic end record says 0xFFFF."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 1)
        data = zip_of(files)
    assert b"PK\x06\x06" in data[-200:]
    return understated(data, 0xFFFF)


@pytest.mark.parametrize("pack", [zip_of, zip64])
def test_a_zip_whose_end_record_lists_too_many_is_refused_before_a_member_is_parsed(
    tokens: dict, zip_infos_built: list[str], pack: Any
) -> None:
    data = pack(files(LIMIT + 1))
    zip_infos_built.clear()
    message = refusal(upload(tokens, data, "many.zip"))
    assert f"many.zip: the archive lists {LIMIT + 1} members" in message
    assert zip_infos_built == []


def test_a_zip_that_understates_its_count_is_refused_at_the_record_past_the_limit(
    tokens: dict, zip_infos_built: list[str]
) -> None:
    data = understated(zip_of(files(3 * LIMIT)), listed=1)
    assert len(zipfile.ZipFile(io.BytesIO(data)).infolist()) == 3 * LIMIT, "zipfile believes the directory"
    zip_infos_built.clear()
    message = refusal(upload(tokens, data, "liar.zip"))
    assert f"the archive lists more than {LIMIT} members" in message
    assert zip_infos_built == []


def test_a_tar_is_refused_at_the_header_past_the_limit(tokens: dict, tar_headers_read: list[str]) -> None:
    data = tar_gz(files(3 * LIMIT))
    message = refusal(upload(tokens, data, "many.tar.gz"))
    assert f"the archive lists more than {LIMIT} members" in message
    assert len(tar_headers_read) == LIMIT + 1, tar_headers_read


def test_directories_and_ignored_files_are_members_too(tokens: dict) -> None:
    ignoring = {**files(LIMIT - 1), ".bungeeignore": b"f0.py\n"}
    assert upload(tokens, tar_gz(ignoring), "ignoring.tar.gz").status_code == 201
    refusal(upload(tokens, tar_gz({**ignoring, "data.bin": b"1"}), "ignoring.tar.gz"))
    with_directory = io.BytesIO()
    with tarfile.open(fileobj=with_directory, mode="w:gz") as archive:
        top = tarfile.TarInfo("task")
        top.type = tarfile.DIRTYPE
        archive.addfile(top)
        for name in files(LIMIT):
            member = tarfile.TarInfo(f"task/{name}")
            member.size = 1
            archive.addfile(member, io.BytesIO(b"x"))
    refusal(upload(tokens, with_directory.getvalue(), "directory.tar.gz"))


@pytest.mark.parametrize("pack", [zip_of, zip64, tar_gz])
def test_an_archive_at_the_limit_is_taken(tokens: dict, pack: Any) -> None:
    reply = upload(tokens, pack(files(LIMIT)), "code")
    assert reply.status_code == 201, reply.content
    assert len(reply.json()["files"]) == LIMIT


def test_the_submit_page_says_the_same_beside_the_archive(users: dict) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    client = Client()
    client.force_login(users["alice"])
    reply = client.post("/jobs/new/", {
        "source": "own-code", "name": "many", "entrypoint": "task:Task", "max_workers": "1",
        "code_file": SimpleUploadedFile("many.zip", zip_of(files(LIMIT + 1))),
    })
    assert reply.status_code == 400
    assert f"the archive lists {LIMIT + 1} members (files and directories); at most {LIMIT} are taken " \
           "(BUNGEE_CODE_MAX_FILES)" in reply.content.decode()
