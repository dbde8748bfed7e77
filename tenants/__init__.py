"""Tenants: isolated per-tenant fact stores (text, K/V records, retrieval index) with metadata in Redis."""
