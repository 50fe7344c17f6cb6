"""A prefix in a bucket as the store uses it: create-only and conditional PUTs, GETs by ETag, listings, the server's
clock. A thin layer over `obstore` (the `s3` extra), configured only from the standard variables:

- S3: `AWS_ENDPOINT_URL` (leave it out for AWS itself), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`
  (and `AWS_SESSION_TOKEN` for temporary keys); `AWS_ALLOW_HTTP=true` for a plain-http endpoint (a server on
  your own machine or network). Without a key in the environment the store refuses to start, unless
  `AWS_EC2_METADATA_DISABLED=false` says to ask the cloud machine's instance metadata for one.
- `gs://` and `az://` take the variables obstore reads for them (`GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_*`).

Every failure becomes a `StoreError` that names what to set; a server that cannot be reached (refused, timed out,
5xx after the client's retries) is `BucketUnavailable`, which the writer treats as "retry later".
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import hashlib
import logging
import os
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .errors import BucketUnavailable, StoreError
from .location import bucket_url

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 120.0
RETRIES = 3  # the client's own retries of one request (transient errors, 5xx), within RETRY_TIMEOUT_S
RETRY_TIMEOUT_S = 10.0
PARALLEL_REQUESTS = 8


class ObjectExists(Exception):
    """A create-only PUT found the key taken."""


class ObjectChanged(Exception):
    """A PUT conditional on an ETag found another version (someone else wrote the object)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int
    etag: str | None
    last_modified: _dt.datetime


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _info(meta: dict[str, Any]) -> ObjectInfo:
    return ObjectInfo(key=str(meta["path"]), size=int(meta.get("size") or 0), etag=meta.get("e_tag"),
                      last_modified=meta["last_modified"])


def md5_etag(data: bytes) -> str:
    """The ETag S3 gives an object written by one plain PUT (the MD5 of its bytes, quoted)."""
    return f'"{hashlib.md5(data).hexdigest()}"'  # noqa: S324 - it is the protocol's checksum, not security


_CHECKED: set[str] = set()  # endpoints + buckets whose conditional writes were checked in this process
_CHECK_LOCK = threading.Lock()


class Bucket:
    """One `scheme://bucket/prefix`. Keys are relative to the prefix. Thread-safe (obstore clients are)."""

    def __init__(self, url: str):
        self.url = bucket_url(url)
        scheme, rest = self.url.split("://", 1)
        self.scheme = scheme.lower()
        self.bucket, _, self.prefix = rest.partition("/")
        try:
            from obstore.store import from_url
        except ImportError as e:  # pragma: no cover - the extra is part of requirements.txt
            raise StoreError(f"{self.url} is on object storage, which needs the s3 extra: "
                             "pip install 'lld-monitor[s3]' (obstore)") from e
        self._check_environment()
        client = {"connect_timeout": _dt.timedelta(seconds=CONNECT_TIMEOUT_S),
                  "timeout": _dt.timedelta(seconds=REQUEST_TIMEOUT_S),
                  "allow_http": _truthy("AWS_ALLOW_HTTP")}
        retry = {"max_retries": RETRIES, "retry_timeout": _dt.timedelta(seconds=RETRY_TIMEOUT_S),
                 "backoff": {"init_backoff": _dt.timedelta(milliseconds=100),
                             "max_backoff": _dt.timedelta(seconds=2), "base": 2.0}}
        try:
            self._store = from_url(self.url, client_options=client, retry_config=retry)
        except Exception as e:  # noqa: BLE001 - obstore raises several kinds for a bad URL or config
            raise StoreError(f"cannot use {self.url}: {str(e).splitlines()[0]}") from e
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.requests = 0  # requests made (a figure for benchmarks and docs)

    # ------------------------------------------------------------------ configuration
    @property
    def where(self) -> str:
        ep = _endpoint() if self.scheme in ("s3", "s3a") else None
        return f"{self.url} (AWS_ENDPOINT_URL={ep})" if ep else self.url

    def _check_environment(self) -> None:
        if self.scheme not in ("s3", "s3a"):
            return
        ep = _endpoint()
        if ep and ep.lower().startswith("http://") and not _truthy("AWS_ALLOW_HTTP"):
            raise StoreError(f"AWS_ENDPOINT_URL={ep} is plain http: set AWS_ALLOW_HTTP=true to use it "
                             "(or give an https:// endpoint)")
        have_key = bool(os.environ.get("AWS_ACCESS_KEY_ID")) and bool(os.environ.get("AWS_SECRET_ACCESS_KEY"))
        other = any(os.environ.get(v) for v in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                                                 "AWS_CONTAINER_CREDENTIALS_FULL_URI"))
        metadata_ok = os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() in ("false", "0", "no")
        if not (have_key or other or metadata_ok or _truthy("AWS_SKIP_SIGNATURE")):
            missing = [v for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(v)]
            raise StoreError(f"no credentials for {self.url}: set {' and '.join(missing)} (and AWS_ENDPOINT_URL for a "
                             "server other than AWS; AWS_SKIP_SIGNATURE=true for a public bucket; "
                             "AWS_EC2_METADATA_DISABLED=false to use a cloud machine's instance role)")

    # ------------------------------------------------------------------ errors
    def _translate(self, exc: BaseException, what: str, key: str | None = None) -> BaseException:
        """obstore's error as ours: missing keys stay FileNotFoundError; the rest say what to set."""
        from obstore import exceptions as oe

        if isinstance(exc, oe.AlreadyExistsError):
            return ObjectExists(key)
        if isinstance(exc, oe.PreconditionError):
            return ObjectChanged(key)
        text = str(exc)
        first = text.splitlines()[0] if text else type(exc).__name__
        status_m = re.search(r"status code: (\d{3})", text)
        status = int(status_m.group(1)) if status_m else None
        code_m = re.search(r"<Code>([^<]+)</Code>", text)
        code = code_m.group(1) if code_m else (str(status) if status else type(exc).__name__)
        if "NoSuchBucket" in text:
            return StoreError(f"the bucket {self.bucket!r} of {self.where} does not exist: create it (the bucket is "
                              "the part after s3://) or fix --store; the server is the one AWS_ENDPOINT_URL names")
        if isinstance(exc, FileNotFoundError):
            return exc
        if (isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or status in (401, 403)
                or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")):
            return StoreError(f"{self.where} refused the credentials ({code}) when trying to {what}: set "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to a key allowed to read and write this "
                              "bucket (and AWS_REGION if the server checks it)")
        if "builder error" in text:
            return StoreError(f"cannot {what} {self.url}: the client refused the endpoint ({first}); for a plain-http "
                              "AWS_ENDPOINT_URL set AWS_ALLOW_HTTP=true")
        if status is None or status >= 500 or status in (408, 429):
            return BucketUnavailable(f"cannot reach {self.where} to {what} ({first[:300]}); check AWS_ENDPOINT_URL "
                                     "and the network")
        return StoreError(f"cannot {what} {key or ''} in {self.url}: {first[:500]}")

    def _call(self, fn, what: str, key: str | None = None):
        from obstore.exceptions import BaseError

        self.requests += 1
        try:
            return fn()
        except (BaseError, FileNotFoundError, OSError) as e:
            raise self._translate(e, what, key) from e

    # ------------------------------------------------------------------ objects
    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        """The object's bytes and metadata; FileNotFoundError if it is not there."""
        import obstore as obs

        def go():
            r = obs.get(self._store, key)
            return bytes(r.bytes()), _info(r.meta)

        return self._call(go, "read", key)

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, ObjectInfo] | None:
        """Like get, but None when the object still has `etag` (a 304: nothing is transferred)."""
        import obstore as obs
        from obstore.exceptions import NotModifiedError

        if etag is None:
            return self.get(key)

        def go():
            try:
                r = obs.get(self._store, key, options={"if_none_match": etag})
            except NotModifiedError:
                return None
            return bytes(r.bytes()), _info(r.meta)

        return self._call(go, "read", key)

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """Several objects at once (PARALLEL_REQUESTS in flight); a missing one raises FileNotFoundError."""
        keys = list(keys)
        if len(keys) <= 1:
            return {k: self.get(k)[0] for k in keys}
        return dict(zip(keys, (b for b, _ in self.map(self.get, keys))))

    def map(self, fn, items: list) -> list:
        """fn over items on the bucket's small thread pool (obstore releases the GIL while it waits)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PARALLEL_REQUESTS, thread_name_prefix="lld-bucket")
        return list(self._pool.map(fn, items))

    def put(self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None) -> str:
        """Write `data` in one PUT (never multipart: the object appears whole or not at all). `create`: only if the key
        is free (else ObjectExists); `if_match`: only over that ETag (else ObjectChanged). Returns the new ETag."""
        import obstore as obs

        mode: Any = "create" if create else ({"e_tag": if_match} if if_match else "overwrite")
        res = self._call(lambda: obs.put(self._store, key, data, mode=mode, use_multipart=False), "write", key)
        return res["e_tag"]

    def delete(self, key: str) -> None:
        import obstore as obs

        try:
            self._call(lambda: obs.delete(self._store, key), "delete", key)
        except FileNotFoundError:
            pass

    def head(self, key: str) -> ObjectInfo:
        import obstore as obs

        return self._call(lambda: _info(obs.head(self._store, key)), "read", key)

    def list_dir(self, prefix: str) -> tuple[list[str], list[ObjectInfo]]:
        """One level under `prefix`: (names of the sub-"folders", objects). One LIST request per 1,000 entries."""
        import obstore as obs

        res = self._call(lambda: obs.list_with_delimiter(self._store, prefix or None), "list", prefix)
        subs = [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]
        return subs, [_info(m) for m in res["objects"]]

    def list_all(self, prefix: str) -> list[ObjectInfo]:
        """Every object under `prefix` (recursive)."""
        import obstore as obs

        def go():
            return [_info(m) for chunk in obs.list(self._store, prefix or None) for m in chunk]

        return self._call(go, "list", prefix)

    # ------------------------------------------------------------------ the server's clock
    def server_time(self, key: str) -> tuple[_dt.datetime, float] | None:
        """(the `Date` of a HEAD response for `key`, time.monotonic() when it came), or None where this client cannot
        make the request (no presigning for this scheme). The server's clock, so a reader never trusts its own."""
        if self.scheme not in ("s3", "s3a"):
            return None
        import obstore as obs

        try:
            url = obs.sign(self._store, "HEAD", key, _dt.timedelta(seconds=60))
        except Exception as e:  # noqa: BLE001 - e.g. anonymous access: no signature to make
            log.debug("cannot presign a HEAD for %s: %s", key, e)
            return None
        self.requests += 1
        req = urllib.request.Request(url, method="HEAD")
        try:
            with urllib.request.urlopen(req, timeout=CONNECT_TIMEOUT_S) as resp:  # noqa: S310 - the store's own URL
                date = resp.headers.get("Date")
        except urllib.error.HTTPError as e:  # a 404 still carries the server's Date
            date = e.headers.get("Date") if e.headers else None
        except (urllib.error.URLError, OSError) as e:
            raise BucketUnavailable(f"cannot reach {self.where} ({e})") from e
        mono = time.monotonic()
        if not date:
            return None
        return email.utils.parsedate_to_datetime(date).astimezone(_dt.timezone.utc), mono

    # ------------------------------------------------------------------ the server's promises
    def check_conditional_writes(self) -> None:
        """Two create-only PUTs of one new key: the second must be refused, or two writers could overwrite each other's
        files unnoticed. Once per endpoint and bucket in a process."""
        ident = f"{_endpoint()}|{self.scheme}://{self.bucket}"
        with _CHECK_LOCK:
            if ident in _CHECKED:
                return
        key = f".lld-probe-{secrets.token_hex(6)}"
        self.put(key, b"1", create=True)
        try:
            self.put(key, b"2", create=True)
        except ObjectExists:
            pass
        else:
            self.delete(key)
            raise StoreError(f"{self.where} does not honour conditional writes (a second create-only PUT of one key "
                             "succeeded): lld-monitor needs them so that two writers never overwrite each other. Use "
                             "a server that supports If-None-Match / If-Match on PUT (AWS S3, SeaweedFS, MinIO).")
        self.delete(key)
        with _CHECK_LOCK:
            _CHECKED.add(ident)
