"""admission"""
