"""An error a request gets back, in OpenAI's shape: an HTTP status and
``{"error": {"message", "type", "param", "code"}}``, which the openai client raises as its
BadRequestError (400), AuthenticationError (401), NotFoundError (404) and so on."""
from __future__ import annotations

from typing import Any

from batchgen.pipeline.errors import BatchgenError

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         409: "invalid_request_error", 413: "invalid_request_error", 405: "invalid_request_error"}


class ApiError(BatchgenError):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def not_found(kind: str, item_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No such {kind}: {item_id!r}", param=param, code=f"{kind}_not_found")
