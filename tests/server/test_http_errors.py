"""The error answers the server and the proxy share, on a bare app: no model, no processes."""
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.http_errors import install_error_handlers
from server.protocol import APIError, CompletionRequest


def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app, "the test app")

    @app.post("/complete")
    async def complete(body: CompletionRequest, limit: int = 1):
        raise APIError(503, "Loading model")

    return TestClient(app)


def test_unknown_path_and_method_are_named():
    missing = client().get("/nowhere")
    assert missing.status_code == 404
    assert missing.json()["error"] == {"code": 404, "message": "/nowhere: no such endpoint on the test app",
                                       "type": "not_found_error"}
    wrong = client().get("/complete")
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] == "GET /complete: method not allowed"


def test_invalid_body_and_query_name_each_field_without_where_it_came_from():
    r = client().post("/complete?limit=x", json={"max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert sorted(r.json()["error"]["message"].split("; ")) == [
        "limit: Input should be a valid integer, unable to parse string as an integer",
        "max_tokens: Input should be greater than or equal to 1", "prompt: field required"]


def test_api_error_answers_as_raised():
    r = client().post("/complete", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
