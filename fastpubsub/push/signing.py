"""Standard Webhooks signatures (https://www.standardwebhooks.com): secrets, and the headers that carry them.

A secret is `whsec_` and 32 random bytes in base64. Each request carries
`webhook-id` (the same on every attempt of a message), `webhook-timestamp`
(Unix seconds when it was sent) and `webhook-signature`: `v1,` and the
base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` under the secret's bytes,
once per secret that signs (during a rotation's grace period, the new and the
previous one, separated by a space; a receiver accepts any signature it can
verify).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable

PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    """A new signing secret, as shown to the subscription's owner (`whsec_...`)."""
    return PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signature(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256>` of the request under one secret."""
    key = base64.b64decode(secret.removeprefix(PREFIX))
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def headers(signing: Iterable[str], webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret in `signing`."""
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(secret, webhook_id, timestamp, body) for secret in signing),
    }
