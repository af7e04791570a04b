"""Errors raised by specsample."""

from __future__ import annotations


class SamplingError(RuntimeError):
    """Input data of some requests was invalid (docs/api.md, guarantee 5); raised with
    ``strict=True``.

    ``requests`` lists the batch indices of the invalid requests; the message names them and
    says what is wrong (NaN / +inf logits, a row with no finite logit, logit_bias or penalties
    that overflowed finite logits, a draft id outside [0, V) other than the -1 placeholder, an
    invalid draft distribution row).
    """

    def __init__(self, requests: list[int], detail: str = "") -> None:
        self.requests = list(requests)
        msg = f"invalid input data in request(s) {self.requests}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
