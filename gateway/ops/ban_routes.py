"""The admin API's bans (gateway/access/bans.py), which `lmqtt ban` calls:

    GET    /api/bans                  {"bans": [ban, ...]}, static ones first
    POST   /api/bans                  {"client_id" | "username" | "address": "...",
                                       "for": "5m" | seconds (optional: no end),
                                       "reason": "..." (optional)}  -> 201 {"ban": ban}
    DELETE /api/bans/{kind}/{value}   -> {"removed": ban}; the value percent-encoded
                                       (an address's "/" as %2F)

    ban := {"kind", "value", "reason", "source": "config" | "admin" | "flapping",
            "created_ms", "until_ms" (null: no end), "remaining_s" (null: no end)}

Bad input is 400 with what is wrong (nothing changed), an unknown ban 404, removing a ban of
the settings 409.
"""

from __future__ import annotations

from gateway.access.bans import KINDS, BanError, BanList, StaticBanError, UnknownBan
from gateway.clock import now_ms
from gateway.ops.admin_api import ApiError, ApiRequest, ApiResponse, Route

__all__ = ["ban_routes"]

_FIELDS = {*KINDS, "for", "reason"}


def _refusal(exc: BanError) -> ApiError:
    if isinstance(exc, UnknownBan):
        return ApiError(404, str(exc))
    if isinstance(exc, StaticBanError):
        return ApiError(409, str(exc))
    return ApiError(400, str(exc))


def ban_routes(bans: BanList) -> list[Route]:
    async def listed(req: ApiRequest) -> ApiResponse:
        now = now_ms()
        return ApiResponse(200, {"bans": [b.view(now) for b in bans.in_force()]})

    async def add(req: ApiRequest) -> ApiResponse:
        doc = req.json()
        if not isinstance(doc, dict):
            raise ApiError(400, "the body must be a JSON object")
        unknown = sorted(set(doc) - _FIELDS)
        if unknown:
            raise ApiError(400, f"unknown field(s) {', '.join(unknown)}: use {sorted(_FIELDS)}")
        targets = [k for k in KINDS if k in doc]
        if len(targets) != 1:
            raise ApiError(400, "name exactly one of client_id, username, address")
        kind = targets[0]
        value, reason, duration = doc[kind], doc.get("reason", ""), doc.get("for")
        if not isinstance(value, str):
            raise ApiError(400, f"{kind} must be a string")
        if not isinstance(reason, str):
            raise ApiError(400, "reason must be a string")
        if duration is not None and not isinstance(duration, str | int | float):
            raise ApiError(400, "for must be seconds or a text such as 5m, 2h, 1d")
        try:
            ban = await bans.add(kind, value, reason=reason, duration_s=duration)
        except BanError as exc:
            raise _refusal(exc) from None
        return ApiResponse(201, {"ban": ban.view(now_ms())})

    async def remove(req: ApiRequest) -> ApiResponse:
        try:
            ban = await bans.remove(req.params["kind"], req.params["value"])
        except BanError as exc:
            raise _refusal(exc) from None
        return ApiResponse(200, {"removed": ban.view(now_ms())})

    return [
        Route("GET", "/api/bans", listed),
        Route("POST", "/api/bans", add),
        Route("DELETE", "/api/bans/{kind}/{value}", remove),
    ]
