"""managed"""
