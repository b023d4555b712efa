"""The OpenAPI document: routes read their bodies themselves (body.py), so each declares its body model with
`body_doc(Model)` and `install` adds the models' schemas to the document."""
from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema


def body_doc(model: type[BaseModel]) -> dict:
    """A route's openapi_extra: its JSON request body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def install(app: FastAPI, bodies: Sequence[type[BaseModel]]) -> None:
    """app.openapi(): FastAPI's document of the routes, plus the schemas of `bodies` (made once, on first use)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in bodies],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
