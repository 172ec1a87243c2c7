"""Reward computation: local rules and serverless HTTP functions."""
