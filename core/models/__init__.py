"""core/models"""
