"""The error answers both HTTP apps (server and proxy) give, in the OpenAI shape: an APIError as it
says, a body or query that fails validation as 400 naming each field, an unknown path or method
as 404/405 naming it."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.protocol import APIError, error_body, validation_problems


def install_error_handlers(app: FastAPI, where: str) -> None:
    """`where` ends the 404 message: "no such endpoint on {where}"."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        # FastAPI's locations start with where the value was ("body", "query"); the field says enough.
        problems = validation_problems({**err, "loc": err["loc"][1:]} for err in e.errors())
        return JSONResponse(error_body(400, "; ".join(problems) or "invalid request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"{request.url.path}: no such endpoint on {where}",
                   405: f"{request.method} {request.url.path}: method not allowed"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)
