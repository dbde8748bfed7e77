"""Bootstrapping: the `inferscale` command line and the local demo.

May import every other inferscale package; nothing imports it.
"""
