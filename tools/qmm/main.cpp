#include <iostream>
#include "qmm/qmm.h"
int main() { std::cout << "qmm\n"; return 0; }
