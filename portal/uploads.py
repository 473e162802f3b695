"""The multipart bodies of the API's uploads (a job's code, an agent's artifacts), read through
one helper so that every fault is answered in the API's error shape, saying what was wrong: a
body of another type (415, as the JSON endpoints answer), a multipart Content-Type without a
boundary Django's parser takes, or a body the parser refuses (400 `malformed_body`, quoting it).
Left to Django, these became a 400 with a message that said nothing.

Django's parser drops a part that the body cuts short before its closing boundary, without a
word: an endpoint that finds a field missing says so (`CUT_SHORT`)."""

from __future__ import annotations

from django.core.exceptions import SuspiciousMultipartForm, TooManyFieldsSent, TooManyFilesSent
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest
from django.http.multipartparser import MultiPartParserError
from django.utils.datastructures import MultiValueDict

from elastic.spec import FieldError
from portal.errors import ApiError

MULTIPART = "multipart/form-data"
CUT_SHORT = "a part the body cuts short before its boundary is dropped"
"""Said where a field is missing: an upload whose body was cut off loses its last part."""

_UNREADABLE = (MultiPartParserError, SuspiciousMultipartForm, TooManyFieldsSent, TooManyFilesSent)


def multipart_files(request: HttpRequest, expected: str) -> MultiValueDict[str, UploadedFile]:
    """The files of `request`'s multipart/form-data body (`expected` names what the endpoint
    takes, for the message: "the archive, in a field named 'file'"). Raises ApiError 415 for a
    body of another type, 400 `malformed_body` for one the multipart parser refuses."""
    content_type = request.headers.get("Content-Type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != MULTIPART:
        raise ApiError(
            415, "unsupported_media_type",
            f"send {expected} as {MULTIPART}, not {media_type or 'a body without a Content-Type'}",
            [FieldError("Content-Type", f"{MULTIPART}; boundary=...", content_type or None)],
        )
    try:
        return request.FILES
    except _UNREADABLE as err:
        raise ApiError(
            400, "malformed_body",
            f"the {MULTIPART} body cannot be read: {err}; send {expected}",
            [FieldError("body", str(err), content_type)],
        ) from err
