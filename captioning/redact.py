"""One redaction for everything capflow writes or prints: MLflow params and tags, the ``config.yaml``
artifact, log and warning messages, error messages, run summaries.

- :func:`redact` masks credentials inside text: the password (or a lone token) of a URL's userinfo
  (``http://alice:PASSWORD@host`` -> ``http://alice:***@host``, ``https://TOKEN@host`` -> ``https://***@host``)
  and the values of secret-looking query parameters (``?token=...``, ``&X-Amz-Signature=...``).
- :func:`redact_obj` applies :func:`redact` to every string of a nested structure and masks the values of
  secret-looking keys (``password``, ``aws_secret_access_key``, ``api_token``, ...).
- :func:`has_credentials` tells whether a URI carries credentials at all (configs refuse those: credentials
  come from the environment, e.g. ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

MASK = "***"
_WORDS = r"secret|password|passwd|pwd|token|credential|access_key|accesskey|api_key|apikey|signature|sig|auth"
#: keys whose values are never written
SECRET_KEY = re.compile(rf"({_WORDS})", re.I)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/?#@\s:]*)(?P<pw>:[^/?#@\s]*)?@")
_QUERY = re.compile(rf"(?P<key>[?&;][^=&#\s]*(?:{_WORDS})[^=&#\s]*=)[^&#\s]+", re.I)


def _userinfo(m: re.Match[str]) -> str:
    if m.group("pw") is not None:
        return f"{m.group('scheme')}{m.group('user')}:{MASK}@"
    return f"{m.group('scheme')}{MASK}@" if m.group("user") else m.group(0)


def redact(text: Any) -> str:
    """``str(text)`` with URL passwords/tokens and secret query values replaced by ``***``."""
    s = str(text)
    if "@" in s:
        s = _USERINFO.sub(_userinfo, s)
    if "=" in s:
        s = _QUERY.sub(lambda m: m.group("key") + MASK, s)
    return s


def redact_obj(obj: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, strings, scalars) with :func:`redact` applied to every string
    and the values of secret-looking keys masked (``None`` stays ``None``: nothing is hidden there)."""
    if isinstance(obj, Mapping):
        return {k: (MASK if obj[k] is not None and SECRET_KEY.search(str(k)) else redact_obj(obj[k])) for k in obj}
    if isinstance(obj, list | tuple):
        return type(obj)(redact_obj(v) for v in obj)
    if isinstance(obj, str):
        return redact(obj)
    return obj


def has_credentials(uri: str) -> bool:
    """True when ``uri`` holds a password in its userinfo (for http(s), any userinfo: a lone name there is
    usually a token) or a secret-looking query parameter."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return redact(uri) != uri
    if parts.password is not None or (parts.username and parts.scheme.lower() in ("http", "https")):
        return True
    return any(SECRET_KEY.search(k) for k, _ in parse_qsl(parts.query, keep_blank_values=True))


__all__ = ["MASK", "SECRET_KEY", "has_credentials", "redact", "redact_obj"]
