"""hdf5/remote.py without a store: which names are URLs, how they are shown (no user info, no
query string), which failures are retried and how often, and which h5serve class each becomes.
The same paths against a real S3 API server: tests/integration/test_remote.py."""

from __future__ import annotations

import errno

import pytest

from h5serve import ConfigError, ObjectAccessDenied, ObjectNotFound, ObjectStoreError, SourceChanged
from h5serve.hdf5 import remote
from h5serve.hdf5.files import expand_paths


class FakeClientError(Exception):
    """What botocore's ClientError carries: ``response`` with the status and the store's code."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"An error occurred ({code}) when calling the GetObject operation")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    """``outer`` raised from ``cause``, as s3fs translates botocore's errors."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


def test_urls_and_paths() -> None:
    assert remote.is_url("s3://b/k.h5") and remote.is_url("https://h/x.h5") and remote.is_url("gs://b/k")
    assert not remote.is_url("/data/x.h5") and not remote.is_url("data/x.h5") and not remote.is_url("file:///x.h5")
    assert remote.parse_url("s3://bucket/a/b.h5") == ("s3", "bucket/a/b.h5")
    assert remote.parse_url("https://h:8/x.h5?sig=1") == ("https", "https://h:8/x.h5?sig=1")
    with pytest.raises(ConfigError, match="names no object"):
        remote.parse_url("s3://bucket")
    with pytest.raises(ConfigError, match="not ftp://"):
        remote.parse_url("ftp://h/x.h5")


def test_shown_urls_carry_no_credentials() -> None:
    assert remote.shown_url("https://user:pw@host/x.h5?X-Amz-Signature=s#f") == "https://host/x.h5"
    assert remote.shown_url("s3://bucket/key.h5") == "s3://bucket/key.h5"


def test_secrets_in_the_environment_are_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    error = remote.remote_error(PermissionError("denied for s3cr3t-value at https://h/x?sig=abc"), "s3://b/k",
                                "reading")
    assert isinstance(error, ObjectAccessDenied)
    assert "s3cr3t-value" not in str(error) and "sig=abc" not in str(error) and "s3://b/k" in str(error)


@pytest.mark.parametrize("exc,cls,status", [
    (raised_from(FakeClientError(404, "NoSuchKey"), FileNotFoundError("k")), ObjectNotFound, 404),
    (FileNotFoundError("k"), ObjectNotFound, 404),
    (raised_from(FakeClientError(403, "AccessDenied"), PermissionError("denied")), ObjectAccessDenied, 403),
    (raised_from(FakeClientError(503, "SlowDown"), OSError(errno.EBUSY, "slow")), ObjectStoreError, 503),
    (raised_from(FakeClientError(412, "PreconditionFailed"), OSError(errno.EINVAL, "pre-conditions")),
     SourceChanged, None),
    (ConnectionResetError(errno.ECONNRESET, "reset by peer"), ObjectStoreError, None),
])
def test_each_failure_becomes_its_class(exc: BaseException, cls: type, status: int | None) -> None:
    error = remote.remote_error(exc, "s3://b/k.h5", "reading")
    assert type(error) is cls and "s3://b/k.h5" in str(error)
    if status is not None:
        assert error.status == status  # type: ignore[attr-defined]


FAST = remote.RetryPolicy(attempts=3, first_s=0.001, cap_s=0.002, deadline_s=5)


def failing(*errors: BaseException) -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "bytes"

    return calls, fn


def test_transient_failures_are_retried_within_the_policy() -> None:
    calls, fn = failing(ConnectionResetError(), raised_from(FakeClientError(503, "SlowDown"), OSError("slow")))
    assert remote.remote_call("s3://b/k", "reading", fn, FAST) == "bytes" and len(calls) == 3  # type: ignore[arg-type]
    calls, fn = failing(*[TimeoutError()] * 5)
    with pytest.raises(ObjectStoreError, match="after 3 tries") as info:
        remote.remote_call("s3://b/k", "reading", fn, FAST)  # type: ignore[arg-type]
    assert len(calls) == 3 and isinstance(info.value.__cause__, TimeoutError)


def test_lasting_failures_are_not_retried() -> None:
    for error in (PermissionError("no"), FileNotFoundError("k"),
                  raised_from(FakeClientError(400, "InvalidRequest"), OSError("bad"))):
        calls, fn = failing(error)
        with pytest.raises((ObjectAccessDenied, ObjectNotFound, ObjectStoreError)):
            remote.remote_call("s3://b/k", "reading", fn, FAST)  # type: ignore[arg-type]
        assert len(calls) == 1


def test_the_deadline_bounds_the_retries() -> None:
    calls, fn = failing(*[ConnectionResetError()] * 50)
    policy = remote.RetryPolicy(attempts=50, first_s=0.05, cap_s=0.05, deadline_s=0.12)
    with pytest.raises(ObjectStoreError):
        remote.remote_call("s3://b/k", "reading", fn, policy)  # type: ignore[arg-type]
    assert 1 < len(calls) < 50


def test_lists_of_urls_stay_urls() -> None:
    files = expand_paths(["s3://b/run_1.h5", "s3://b/run_0.h5"])
    assert files.paths == ("s3://b/run_1.h5", "s3://b/run_0.h5")  # the order given, not made local paths
    assert expand_paths("https://h/x.h5?a=1").paths == ("https://h/x.h5?a=1",)  # a query is no pattern


def test_without_fsspec_a_url_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if not installed: ``import fsspec`` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'h5serve\[s3\]'"):
        remote.open_remote("s3://bucket/train.h5")
    with pytest.raises(ConfigError, match=r"pip install 'h5serve\[gcs\]'"):
        remote.open_remote("gs://bucket/train.h5")
