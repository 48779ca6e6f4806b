# Turns a text file into a C source defining kv_corpus_data / kv_corpus_len.
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x..,){24})" "\\1\n" body "${body}")
file(WRITE ${OUT} "/* generated from data/corpus.txt by tools/embed.cmake */\n#include <stddef.h>\nconst unsigned char kv_corpus_data[] = {\n${body}0x00};\nconst size_t kv_corpus_len = ${len};\n")
