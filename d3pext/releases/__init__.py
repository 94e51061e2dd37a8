"""Releases: the mechanisms a curator privatizes statistics with, and what a release carries."""
