"""Explaining real predictions (`explain`) and measuring which explanation to trust (`evaluate`)."""

from mixlens.explain.explain import explain
from mixlens.result import Explanation
from mixlens.targets import Target

__all__ = ["Explanation", "Target", "explain"]
