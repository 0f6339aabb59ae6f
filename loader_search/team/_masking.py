"""Passwords never shown: masking storage URLs, and the secrets a driver's message or free
text may quote. Every URL shown to a user goes through `mask_url`."""

from __future__ import annotations

import re

from sqlalchemy.engine import URL, make_url

# Query parameters that may carry secrets: password, passwd, pwd, sslpassword, api_token...
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key", re.IGNORECASE)
# Shorter secrets would be replaced inside ordinary words, which reveals them: such messages
# are dropped instead of masked.
_MIN_MASKABLE = 4


def authority_is_ambiguous(url: str) -> bool:
    """``user:p@ss@host`` or ``user:p/ss@host``: an unencoded ``@`` or ``/`` in the user
    name or password, which parsers split wrongly (the password then lands in the host or
    the database name, where no masking finds it). Any ``@`` outside ``user:pw@host`` is
    taken as such."""
    _, sep, rest = url.partition("://")
    if not sep:
        return False
    in_authority = rest.split("/", 1)[0].count("@")
    return in_authority > 1 or rest.count("@") > in_authority


def _secrets(url: URL) -> list[str]:
    values = [url.password] if url.password else []
    for key, value in url.query.items():
        if _SECRET_KEY.search(key):
            values.extend([value] if isinstance(value, str) else list(value))
    return [str(v) for v in values if v]


def has_password(url: str) -> bool:
    """Whether ``url`` holds a password that `mask_url` would hide: in ``user:pw@`` or a
    query option such as ``?password=``. A URL with an unencoded ``@`` counts as one (what
    it holds cannot be told apart), an unparsable one when its text looks like one."""
    if authority_is_ambiguous(url):
        return True
    try:
        return bool(_secrets(make_url(url)))
    except Exception:
        return scrub_urls(url) != url


def mask_url(url: str) -> str:
    """The URL with any password (``user:pw@``, ``?password=``, ``?sslpassword=``...)
    replaced by ``***``; unparsable or ambiguous input is hidden whole."""
    if authority_is_ambiguous(url):
        return "<storage URL with an unencoded @>"
    try:
        parsed = make_url(url)
        hidden = {k: "***" for k in parsed.query if _SECRET_KEY.search(k)}
        masked = parsed.update_query_dict(hidden)._replace(database=None)
        head, sep, query = masked.render_as_string(hide_password=True).partition("?")
    except Exception:
        return "<unparsable storage URL>"
    # SQLAlchemy percent-encodes the database part (``:memory:`` as ``%3Amemory%3A``, a
    # path's spaces and accents): it holds no password, so it is shown as written, put back
    # before the query (the first ``?``: a user name is encoded and a host holds none). Only
    # ``%`` and ``?`` stay encoded, so the URL shown opens the same database.
    database = "" if parsed.database is None else "/" + parsed.database
    database = database.replace("%", "%25").replace("?", "%3F")
    return head + database + sep + query.replace("%2A%2A%2A", "***")


_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^:/@\s]*:)[^@\s]+@")


# ``password=...`` in a libpq connection string, a URL's query or a driver's keyword arguments.
_KEY_PASSWORD = re.compile(
    r"""(\b(?:ssl)?(?:password|passwd|pwd)['"]?\s*[=:]\s*['"]?)[^\s&'",)]+""", re.IGNORECASE
)


def scrub_urls(text: str) -> str:
    """Mask the password of any URL inside free text (an unexpected error's message, a
    traceback), and any ``password=...`` pair."""
    return _KEY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


def mask_in(text: str, url: str) -> str:
    """Remove any password from a driver's message, should it quote one."""
    try:
        secrets = _secrets(make_url(url))
    except Exception:
        return "(details hidden: they may contain the password)"
    for secret in secrets:
        if len(secret) < _MIN_MASKABLE:
            return "(details hidden: they may contain the password)"
        text = text.replace(secret, "***")
    return text
