"""Shared pytest configuration for the whole suite.

Area-specific fixtures live in the conftest.py of each tests/<area>/ folder.
"""
