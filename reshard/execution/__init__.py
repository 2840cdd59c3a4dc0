"""Executing a plan: reading source bytes, assembling destination items, workers, the resume journal.
"""
