"""How a fleet host proves its /ready answer to the peer that asked: HMAC-SHA256, under the fleet's shared key
([fleet] key_file), of the reader's fresh challenge, the host's name, the status and the fleet headers. Without
the key nobody answers for a peer (a fake "draining" or claim that blocks every restart, a fake "ready"), and
an answer recorded once is no good for the next challenge. The key itself never crosses the network.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence

CHALLENGE = "X-Llm-Appliance-Challenge"
HOST = "X-Llm-Appliance-Host"
PROOF = "X-Llm-Appliance-Proof"
CHALLENGE_BYTES = 16


def challenge() -> str:
    return secrets.token_hex(CHALLENGE_BYTES)


def proof(
    key: bytes, challenge: str, status: int, body: bytes, headers: Mapping[str, str], signed: Sequence[str]
) -> str:
    """The proof over the status, the body (the reason not ready) and `signed` headers (in that order; a missing
    one counts as empty)."""
    text = "\n".join([challenge, str(status), *(f"{name}:{headers.get(name, '')}" for name in signed), ""])
    return hmac.new(key, text.encode() + body, hashlib.sha256).hexdigest()


def proven(
    key: bytes,
    challenge: str,
    answer: tuple[int, bytes, Mapping[str, str]],
    signed: Sequence[str],
    host: str,
) -> bool:
    """Whether the answer (status, body, headers) comes from `host`, holding the key, for this challenge."""
    status, body, headers = answer
    if headers.get(HOST) != host:
        return False
    return hmac.compare_digest(proof(key, challenge, status, body, headers, signed), headers.get(PROOF, ""))


def well_formed(challenge: str) -> bool:
    """A challenge as readers send it (a bound on what is hashed for whoever asks)."""
    return len(challenge) == 2 * CHALLENGE_BYTES and all(c in "0123456789abcdef" for c in challenge)
