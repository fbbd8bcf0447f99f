"""guard.counting"""
