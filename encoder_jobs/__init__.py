"""Encoder jobs: a tenant's conversation in, context-window-encoded facts out, through the tenant store."""
