"""core/native"""
