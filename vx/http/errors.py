"""HTTP errors in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.

Runs in: the ApiServer process. This is the one place where failures become HTTP statuses
(style: "formatting stays in the HTTP layer"). Bad input is always a 4xx; a 5xx means the
server or the engine failed.
"""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

#: Seconds a client should wait before retrying a 503.
RETRY_AFTER_S = 5

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}

_ENCODER = msgspec.json.Encoder()


class APIError(Exception):
    """An error answered with `status` and the OpenAI envelope.

    `param` names the request field at fault, when one is; `code` is a stable machine-readable
    string (`context_length_exceeded`, `invalid_api_key`, `model_not_found`, ...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("retry-after", str(RETRY_AFTER_S))

    def body(self) -> dict[str, object]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> Response:
        return error_response(
            self.status, self.message, param=self.param, code=self.code, headers=self.headers
        )


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = _ENCODER.encode(error_body(status, message, param=param, code=code))
    return Response(body, status_code=status, headers=headers, media_type="application/json")


_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*)")
_MISSING = re.compile(r"missing required field `([A-Za-z_][A-Za-z0-9_]*)`")
#: Top-level fields whose errors name the whole path, as OpenAI's do (`messages[0].role`);
#: errors in other fields name only the top-level field.
_FULL_PATH_FIELDS = frozenset({"messages"})


def from_validation_error(e: msgspec.MsgspecError) -> APIError:
    """A msgspec decode or validation failure as a 400 naming the field when it can."""
    text = str(e)
    if isinstance(e, msgspec.ValidationError):
        param = None
        path, missing = _PATH.search(text), _MISSING.search(text)
        if path is not None:
            param = path.group(1)
            if param in _FULL_PATH_FIELDS:
                param += path.group(2) + (f".{missing.group(1)}" if missing else "")
        elif missing is not None:
            param = missing.group(1)
        return APIError(400, text, param=param, code="invalid_type")
    return APIError(
        400, f"We could not parse the JSON body of your request: {text}", code="invalid_json"
    )


def context_length_error(
    prompt_len: int, max_tokens: int | None, max_model_len: int, *, param: str = "prompt"
) -> APIError:
    """OpenAI's wording, which client libraries match on, plus vLLM's numbers."""
    if max_tokens is None or prompt_len >= max_model_len:
        detail = f"However, your prompt has {prompt_len} tokens."
    else:
        detail = (
            f"However, you requested {prompt_len + max_tokens} tokens "
            f"({prompt_len} in the prompt, {max_tokens} for the completion)."
        )
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. {detail} "
        "Please reduce the length of the prompt or the completion.",
        param=param,
        code="context_length_exceeded",
    )
