"""The errors of the tenants layer; each carries the HTTP status the serving layer answers with."""


class TenantError(Exception):
    """Base class: a request this layer refuses, with a message meant for the caller."""

    http_status = 400


class AuthError(TenantError):
    """Missing, malformed or wrong API key."""

    http_status = 401


class UnknownTenantError(TenantError):
    """No tenant has this id."""

    http_status = 404


class TenantExistsError(TenantError):
    """A tenant with this id exists already."""

    http_status = 409


class FactNotFoundError(TenantError):
    """The tenant has no (visible) fact with this id."""

    http_status = 404


class JobNotFoundError(TenantError):
    """The tenant has no encoding job with this id."""

    http_status = 404


class FactExistsError(TenantError):
    """The tenant already has a fact with this id."""

    http_status = 409


class ConflictError(TenantError):
    """The fact changed concurrently; retry with its current version."""

    http_status = 409


class InvalidInputError(TenantError):
    """Empty, oversized or malformed input (text, id, k, quota values)."""

    http_status = 422


class QuotaExceededError(TenantError):
    """The change would take the tenant past its quota of facts or bytes."""

    http_status = 413


class RateLimitedError(TenantError):
    """The tenant sent more requests than its rate allows; retry after a moment."""

    http_status = 429
