"""Where an ``s3://`` store's credentials come from, decided before any request, in the order of the AWS
SDKs' default chain; none anywhere is one line ("no credentials for the store"), with no environment switch
needed to get it.

1. Keys: ``access_key_id`` in the storage options or ``AWS_ACCESS_KEY_ID`` (the client reads them), or
   anonymous access asked for (``skip_signature=true``, a public bucket).
2. A profile: ``AWS_PROFILE``, else ``default``, in ``AWS_SHARED_CREDENTIALS_FILE`` (``~/.aws/credentials``)
   or ``AWS_CONFIG_FILE`` (``~/.aws/config``). A named profile that is in neither file is refused. A
   profile with credentials goes through boto3 when it is installed (roles, SSO, ``credential_process``);
   without boto3 its static keys are read here, and any other kind is refused in one line.
3. Web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``) or a container's credentials endpoint
   (``AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`` / ``_FULL_URI``): the client's own providers.
4. The EC2 instance metadata service, if it answers within ``IMDS_TIMEOUT_S`` (a session-token PUT, then
   the role list, as the SDKs ask it). Not asked when ``AWS_EC2_METADATA_DISABLED=true``, nor when an
   endpoint is configured (a custom endpoint is never EC2's S3). Its address: ``metadata_endpoint`` in the
   storage options, ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (the SDKs' variable), ``AWS_METADATA_ENDPOINT``
   (the client's), else ``http://169.254.169.254``; the client is given the same one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from zckpt.errors import StorageError

IMDS = "http://169.254.169.254"
IMDS_TIMEOUT_S = 1.0
"""The whole instance-metadata probe (botocore's default ``metadata_service_timeout``)."""
_PROFILE_KEYS = frozenset(
    {
        "aws_access_key_id",
        "role_arn",
        "credential_source",
        "credential_process",
        "sso_session",
        "sso_start_url",
        "web_identity_token_file",
        "login_session",
    }
)
"""A profile holding any of these gives credentials (static keys, a role, SSO, a process...)."""
_NO_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
    "--storage-option skip_signature=true for a public bucket"
)


class Source(Enum):
    KEYS = "keys"
    ANONYMOUS = "anonymous"
    PROFILE = "profile"
    WEB_IDENTITY = "web identity"
    CONTAINER = "container"
    INSTANCE_METADATA = "instance metadata"


@dataclass(frozen=True)
class Found:
    """Where the credentials come from, and what to add to the client's configuration for it."""

    source: Source
    profile: str | None = None
    config: Mapping[str, str] = field(default_factory=dict)
    """A profile's static keys (no boto3), or the metadata endpoint when it is not the default."""


def _true(v: str | None) -> bool:
    return (v or "").strip().lower() == "true"


def _profiles(env: Mapping[str, str], home: str) -> dict[str, dict[str, str]]:
    """Every profile in the shared credentials and config files, by name (a profile named in both is
    merged, the credentials file winning, as the SDKs do)."""
    creds = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    import configparser  # here, not at import: a local command's start-up never reads these files

    out: dict[str, dict[str, str]] = {}
    for path, is_config in ((conf, True), (creds, False)):
        p = configparser.RawConfigParser(default_section="\0none")
        try:
            p.read(os.path.expanduser(path))
        except configparser.Error:
            raise StorageError(
                f"{path}: not an AWS config or credentials file",
                hint="fix the file's [section] and key = value lines",
            ) from None
        for section in p.sections():
            name = section.removeprefix("profile ").strip() if is_config else section.strip()
            out.setdefault(name, {}).update(dict(p.items(section)))
    return out


def imds_answers(address: str, timeout: float = IMDS_TIMEOUT_S) -> bool:
    """The instance metadata service at ``address`` (``http://host[:port]``) gives a role's credentials:
    a session token (IMDSv2, what the client uses) and a role name, both within ``timeout`` seconds in all.
    Never through a proxy (the SDKs' rule: the service is link-local)."""
    import http.client  # here, not at import (start-up of the local commands)

    u = urlsplit(address)
    deadline = time.monotonic() + timeout

    def ask(method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=left)
        try:
            conn.request(method, path, headers=headers)
            r = conn.getresponse()
            return r.status, r.read(4096)
        finally:
            conn.close()

    try:
        status, token = ask("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
        if status != 200 or not token:
            return False
        status, roles = ask(
            "GET",
            "/latest/meta-data/iam/security-credentials/",
            {"X-aws-ec2-metadata-token": token.decode("ascii", "replace")},
        )
        return status == 200 and bool(roles.strip())
    except (OSError, http.client.HTTPException, TimeoutError):
        return False


def resolve(
    url: str,
    config: Mapping[str, str],
    env: Mapping[str, str],
    *,
    endpoint: str | None,
    home: str | None = None,
    imds: str | None = None,
) -> Found:
    """The first source of the chain that has credentials (see the module's docstring), or the one line
    saying there are none. ``imds`` overrides the metadata service's address (tests)."""
    if config.get("access_key_id") or env.get("AWS_ACCESS_KEY_ID"):
        return Found(Source.KEYS)
    if _true(config.get("skip_signature")) or _true(env.get("AWS_SKIP_SIGNATURE")):
        return Found(Source.ANONYMOUS)
    named = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    profiles = _profiles(env, home or os.path.expanduser("~"))
    if named and named not in profiles:
        raise StorageError(
            f"{url}: no AWS profile {named!r} in ~/.aws/config or ~/.aws/credentials",
            hint="check AWS_PROFILE (aws configure list-profiles), or set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY",
            path=url,
        )
    name = named or "default"
    if _PROFILE_KEYS & set(profiles.get(name, {})):
        return Found(Source.PROFILE, profile=name)
    if config.get("web_identity_token_file") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return Found(Source.WEB_IDENTITY)
    containers = ("container_credentials_relative_uri", "container_credentials_full_uri")
    if any(config.get(k) or env.get(f"AWS_{k.upper()}") for k in containers):
        return Found(Source.CONTAINER)
    if not endpoint and not _true(env.get("AWS_EC2_METADATA_DISABLED")):
        address = (
            imds
            or config.get("metadata_endpoint")
            or env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
            or env.get("AWS_METADATA_ENDPOINT")
            or IMDS
        )
        if imds_answers(address):
            extra = {} if address == IMDS else {"metadata_endpoint": address}
            return Found(Source.INSTANCE_METADATA, config=extra)
    raise _none(url)


def _none(url: str) -> StorageError:
    return StorageError(f"{url}: no credentials for the store", hint=_NO_CREDENTIALS_HINT, path=url)


def for_client(
    url: str, config: Mapping[str, str], env: Mapping[str, str], *, endpoint: str | None
) -> tuple[dict[str, str], Any]:
    """What the client needs for the credentials ``resolve`` finds: keys to add to its configuration, and a
    credential provider (a profile, through boto3) or None."""
    found = resolve(url, config, env, endpoint=endpoint)
    if found.source is not Source.PROFILE:
        return dict(found.config), None
    assert found.profile is not None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return _static_keys(url, found.profile, _profiles(env, os.path.expanduser("~"))[found.profile]), None
    try:
        return {}, Boto3CredentialProvider(boto3.Session(profile_name=found.profile))
    except ValueError:  # the profile's chain found nothing (session.get_credentials() is None)
        raise StorageError(
            f"{url}: no credentials for the store", hint=_NO_CREDENTIALS_HINT, path=url
        ) from None
    except Exception as e:  # noqa: BLE001 - botocore's own errors (an SSO login expired...): one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise StorageError(
            f"{url}: AWS profile {found.profile!r}: {first}",
            hint="check the profile (aws configure list --profile NAME)",
            path=url,
        ) from None


def _static_keys(url: str, name: str, profile: Mapping[str, str]) -> dict[str, str]:
    """A profile's static keys, for the client's configuration (boto3 not installed)."""
    if "aws_access_key_id" not in profile or "aws_secret_access_key" not in profile:
        raise StorageError(
            f"{url}: AWS profile {name!r} needs boto3 (it has no static keys)",
            hint="pip install boto3, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            path=url,
        )
    out = {
        "access_key_id": profile["aws_access_key_id"],
        "secret_access_key": profile["aws_secret_access_key"],
    }
    if profile.get("aws_session_token"):
        out["session_token"] = profile["aws_session_token"]
    return out
