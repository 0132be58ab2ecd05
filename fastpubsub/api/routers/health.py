"""Probes and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from fastpubsub.api.deps import DatabaseDep, PrincipalDep
from fastpubsub.api.errors import error_response, error_responses
from fastpubsub.api.schemas import ErrorBody, Status
from fastpubsub.exceptions import DatabaseUnavailableError, NotMigratedError
from fastpubsub.migrate import SchemaExpectation

router = APIRouter(tags=["operations"])


@router.get("/liveness", summary="The process is alive (always 200)")
async def liveness() -> Status:
    return Status(status="alive")


@router.get(
    "/readiness",
    summary="The database answers and its schema is the one this server needs (200), or not (503)",
    responses={
        503: {
            "model": ErrorBody,
            "description": "The database is unreachable, or not migrated to the revision this server needs",
        }
    },
)
async def readiness(request: Request, database: DatabaseDep) -> Status:
    try:
        revision = await database.schema_revision()
    except NotMigratedError:
        revision = None
    except DatabaseUnavailableError:
        return error_response(503, "database is down")  # type: ignore[return-value]
    expectation: SchemaExpectation = request.app.state.schema_expectation
    problem = expectation.problem(revision)
    if problem is not None:
        return error_response(503, problem)  # type: ignore[return-value]
    return Status(status="ready")


@router.get(
    "/metrics",
    summary="Prometheus metrics: HTTP, broker counters and subscription backlogs",
    description="With auth on, needs the `metrics:read` scope (give Prometheus a client of its own).",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        },
        **error_responses(401, 403),
    },
)
async def metrics(request: Request, principal: PrincipalDep) -> Response:
    principal.require("metrics:read")
    body = await request.app.state.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
