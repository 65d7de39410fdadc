"""Admission control: what one API call may cost, and how much work the server takes on.

Each call is first checked against per-call bounds (prompts, sequences, prompt-logprob
tokens): past one, a 400 names the limit. It is then admitted against the
server's capacity: the running batch (``max_num_seqs``) plus a bounded wait
(``max_queued_requests`` sequences, ``max_queued_tokens`` prompt tokens). Past that the call is
refused at once with a 429 and ``Retry-After`` (503 while the engine starts), instead of
queueing for minutes; so is a client that holds half of that capacity while another client
holds some (``client_of`` names the client: the peer address, or a trusted proxy's header).
A ``Ticket`` holds a call's share until its streams end.
"""

from __future__ import annotations

from warmboot.server.config import AdmissionLimits
from warmboot.server.fields import UnsupportedParameter


class Overloaded(Exception):
    """The server is at capacity: a 429 with ``Retry-After``."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Ticket:
    """One admitted call's share of the capacity; ``release`` is idempotent."""

    def __init__(self, admission: Admission, seqs: int, client: str):
        self._admission, self.seqs, self.tokens, self.client = admission, seqs, 0, client

    def add_tokens(self, tokens: int) -> None:
        """The call's prompt tokens, once known; past the bound, release and refuse."""
        admission = self._admission
        self.tokens += tokens
        admission.tokens += tokens
        if admission.tokens > admission.limits.max_queued_tokens:
            self.release()
            admission.rejected("tokens")
            raise Overloaded(
                f"the server is at capacity: {admission.limits.max_queued_tokens} prompt "
                "tokens in flight (--max-queued-tokens); retry shortly"
            )

    def release(self) -> None:
        if self._admission is None:
            return
        admission = self._admission
        admission.seqs -= self.seqs
        admission.tokens -= self.tokens
        admission.by_client[self.client] -= self.seqs
        if not admission.by_client[self.client]:
            del admission.by_client[self.client]
        self._admission = None


class Admission:
    def __init__(self, limits: AdmissionLimits, metrics=None):
        self.limits, self.metrics = limits, metrics
        self.seqs = 0
        self.tokens = 0
        self.by_client: dict[str, int] = {}
        if metrics is not None:
            metrics.in_flight.set_function(lambda: self.seqs)

    def check_cost(self, prompts: int, n: int, least: int, prompt_logprobs: bool) -> None:
        """Per-call bounds from what is known before tokenizing (a 400 naming the limit);
        ``least``: a lower bound on the call's prompt tokens (``least_tokens``)."""
        lim = self.limits
        if prompts > lim.max_prompts_per_request:
            _too_much(
                "prompt",
                f"{prompts} prompts in one request; at most "
                f"{lim.max_prompts_per_request} (--max-prompts-per-request)",
            )
        capacity = lim.max_num_seqs + lim.max_queued_requests
        if prompts * n > min(lim.max_seqs_per_request, capacity):
            _too_much(
                "n",
                f"{prompts} prompts x n={n} = {prompts * n} sequences; at most "
                f"{min(lim.max_seqs_per_request, capacity)} per request",
            )
        if prompt_logprobs and least > lim.max_prompt_logprob_tokens:
            _too_much(
                "prompt_logprobs",
                f"prompt logprobs over at least {least} prompt tokens; "
                f"at most {lim.max_prompt_logprob_tokens} per request",
            )

    def admit(self, seqs: int, client: str = "") -> Ticket:
        """Take ``seqs`` sequences of capacity for ``client``, or raise ``Overloaded``."""
        capacity = self.limits.max_num_seqs + self.limits.max_queued_requests
        if seqs > capacity - self.seqs:
            self.rejected("requests")
            raise Overloaded(
                f"the server is at capacity: {self.seqs} sequences in flight, of which at most "
                f"{self.limits.max_queued_requests} may wait (--max-queued-requests); "
                "retry shortly"
            )
        held = self.by_client.get(client, 0)
        if held + seqs > capacity // 2 and self.seqs > held:
            self.rejected("client")
            raise Overloaded(
                f"this client holds {held} of the server's {capacity} places while other "
                "clients wait; one client may hold at most half of them; retry shortly"
            )
        self.seqs += seqs
        self.by_client[client] = held + seqs
        if self.metrics is not None:
            self.metrics.admitted.inc()
        return Ticket(self, seqs, client)

    def rejected(self, why: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(why).inc()

    def state(self) -> dict:
        return {"seqs_in_flight": self.seqs, "prompt_tokens_in_flight": self.tokens}


def client_of(request, header: str | None) -> str:
    """Who sent ``request`` (fair scheduling and shares): ``header``'s value when the server is
    told to trust it (a proxy sets it) and it is present, else the peer's address."""
    if header:
        value = request.headers.get(header)
        if value:
            return f"h:{value}"
    return request.client.host if request.client is not None else ""


SLACK = 2
"""Normalizers may shrink a text (composing accents): bounds allow for half."""


def least_tokens(chars: int, max_token_chars: int) -> int:
    """A lower bound on the tokens of ``chars`` characters of text."""
    return chars // (SLACK * max(max_token_chars, 1))


def check_length(chars: int, max_token_chars: int, max_tokens: int, param: str, what: str):
    """Refuse, before rendering or tokenizing it, an input of ``chars`` characters that must
    hold more than ``max_tokens`` tokens (a 400 naming ``param``)."""
    least = least_tokens(chars, max_token_chars)
    if least > max_tokens:
        raise UnsupportedParameter(
            param,
            f"{what} too long: at least {least} tokens ({chars} characters); at most {max_tokens}",
        )


def _too_much(param: str, message: str) -> None:
    raise UnsupportedParameter(param, f"the request is too large: {message}")
